"""Lowest layer: hashing, the canary record layout, fail reasons and launch tags."""
