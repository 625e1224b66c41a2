"""Planning: pure numpy over example lengths, never tokens: which examples share a row (`plan`, `repack`),
the padding a row asks for and each context-parallel rank's share of it (`context_parallel`), and every
example's fate and count (`accounting`). No I/O; every stage below may call it."""
