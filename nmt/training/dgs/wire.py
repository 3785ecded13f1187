"""The wire codes of the asynchronous trainer: what each point-to-point message between the parameter
server and a worker is.

Every message is an 8-word float64 header (tag 1) whose word 0 is a message code, then, for an update, its
`compression.dgs.Update.pack()`ed fp32 payload (tag 2): sparse = values then int32 indices bit-cast (8 bytes
per entry), dense/params = n values (4 bytes each). The update's arithmetic and payload layout are
compression's; these codes and tags are the transport's, so they live here, next to the processes.
"""

from __future__ import annotations

from compression.dgs import DENSE, PARAMS, SPARSE

HEADER_WORDS = 8
TAG_HEADER, TAG_PAYLOAD = 1, 2
CODES = {SPARSE: 1, DENSE: 2, PARAMS: 3}  # an update of that kind follows
KINDS = {code: kind for kind, code in CODES.items()}
SAVE, STOP = 4, 5  # server -> workers: write your part of a checkpoint / the run is over
