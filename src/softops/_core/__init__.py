"""Private numerical core. Imports nothing from the rest of softops."""
