"""stepflow: eval."""
