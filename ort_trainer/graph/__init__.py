"""The graph pipeline: export, trainability pass, gradient and optimizer graphs, cache."""
