// Compiles the precompiled header once; every target reuses it.
