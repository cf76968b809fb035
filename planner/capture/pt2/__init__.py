"""Reading `.pt2` files from anywhere before torch deserializes them (README.md)."""
