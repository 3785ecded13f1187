"""Checkpoints: the format (format.py), writing (writer.py), loading for decoding (inference.py), resuming
(resume.py) and the model directory's lock (lock.py).

A package of its own, below `nmt.training`: decoding, scoring and export load models through it without
importing the training code.
"""

from nmt.checkpoint.format import (
    LOCK_FILE,
    META_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    CheckpointError,
    ModelDirLocked,
    WorldSizeMismatch,
    first_non_finite,
    rank_state_file,
    step_dir_name,
)
from nmt.checkpoint.inference import InferenceBundle, load_inference_bundle, resolve_checkpoint
from nmt.checkpoint.lock import ModelDirLock, acquire_model_dir_lock
from nmt.checkpoint.resume import (
    check_world_size,
    checkpoint_complete,
    find_resume_dir,
    load_training_state,
    repair_last_link,
    restore_best_link,
    saved_world_size,
    step_checkpoints,
)
from nmt.checkpoint.writer import CheckpointWriter, remove_checkpoint_leftovers

__all__ = [
    "LOCK_FILE",
    "META_FILE",
    "MODEL_FILE",
    "VOCAB_FILE",
    "CheckpointError",
    "CheckpointWriter",
    "InferenceBundle",
    "ModelDirLock",
    "ModelDirLocked",
    "WorldSizeMismatch",
    "acquire_model_dir_lock",
    "check_world_size",
    "checkpoint_complete",
    "find_resume_dir",
    "first_non_finite",
    "load_inference_bundle",
    "load_training_state",
    "rank_state_file",
    "remove_checkpoint_leftovers",
    "repair_last_link",
    "resolve_checkpoint",
    "restore_best_link",
    "saved_world_size",
    "step_checkpoints",
    "step_dir_name",
]
