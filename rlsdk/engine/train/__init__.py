"""The train engine (runs inside the ranks) and the canonical checkpoint layout."""
