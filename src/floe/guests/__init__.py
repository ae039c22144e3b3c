"""Guest modules shipped with floe (built from guests/ by guests/build.py)."""
