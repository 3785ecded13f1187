"""Export trained checkpoints to other inference runtimes (`nmt-export`); CTranslate2 so far.

Each runtime lives in its own module and is imported lazily, so the toolkit does not depend on it.
"""
