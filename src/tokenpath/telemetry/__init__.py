"""Where did the time go: the per-request Timeline and everything derived from it."""
