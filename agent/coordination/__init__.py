"""Coordination: who approves an event, through the peers or through a blob store."""
