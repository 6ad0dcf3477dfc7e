"""maintd: turns Azure Scheduled Events into safe, automatic preparation for maintenance."""

__version__ = "0.2.0"
