"""Artifacts on disk: native head checkpoints and artifact markers (checkpoint.py), the export formats, one
module each, and their registry (formats/), exporting and loading over it (export.py), the validator CLI
(validate.py). Writes go through `core.files.atomic_dir`; heads/ itself opens no file."""
