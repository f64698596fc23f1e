"""The ctj operator: kopf handlers for CheckpointedTrainingJob (see DESIGN.md)."""
