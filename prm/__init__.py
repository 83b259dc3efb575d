"""stepflow: prm."""
