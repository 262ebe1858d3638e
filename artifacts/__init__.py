"""Artifacts on disk: native head checkpoints, every engine export format, their validators and the
draft-hf reader/writer. Writes go through `core.files.atomic_dir`; heads/ itself opens no file."""
