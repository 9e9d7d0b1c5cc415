"""The session's one local Ray cluster (started on first use, shared by every test that needs it)."""
