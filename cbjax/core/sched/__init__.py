"""Scheduling: which requests compute how many tokens each step, under which policy."""
