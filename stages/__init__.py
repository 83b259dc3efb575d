"""stepflow: stages."""
