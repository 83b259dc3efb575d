"""stepflow: pipeline."""
