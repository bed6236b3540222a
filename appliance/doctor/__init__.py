"""`dgpp doctor`: a node's health for serving, one check at a time (docs/operations.md, "First
start on a Spark")."""
