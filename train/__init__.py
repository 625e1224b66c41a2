"""Example training loop and the padded-vs-packed benchmark; imports packer, never the reverse."""
