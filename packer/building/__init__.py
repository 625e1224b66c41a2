"""Building: source → format → tokenize → mix → spill → plan → write → commit, end to end in `pipeline`.
Never imports `checking` or `training` (the build never needs torch)."""
