"""Builder: find attention blocks in exported graphs, rewrite them into the pagedkv plugins, build and compare."""
