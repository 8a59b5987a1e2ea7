"""Models: their shapes and configs, the Hub's model folders, and the engine sizes a shape needs."""
