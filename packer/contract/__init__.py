"""The contract: what a build is (`config`, `recipes`) and what it stores (`schema`: the on-disk format,
names and manifest; `rows`: the row invariants every reader checks). Written by `building`, read by
`checking` and `training`."""
