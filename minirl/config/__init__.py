"""The recipe: its typed sections, the TOML files and `--set` flags that fill them, and the rules across fields."""
