"""The serving engine: requests, block allocation, scheduling, and the device step."""
