"""Speculative decoding's host policy (issue 37): its config, the drafts each step verifies, its counters."""
