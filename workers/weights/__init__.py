"""Model sources and their weights: what a source names, loading it, and sharing it between copies."""
