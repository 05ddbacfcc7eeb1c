"""The `deadpool` command line: demo, up, launch, status, and the three services."""
