"""The asynchronous trainer of `exchange.method: dgs`: a parameter server and N workers (docs/dgs.md).

`entry` starts a job's roles, `server` and `worker` are their loops, `transport` and `wire` the messages
between them; the arithmetic they run is `compression.dgs`'s.
"""
