"""Speculative-decoding proposers (issue 37): host-side drafts the step verifies."""
