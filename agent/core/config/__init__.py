"""Node configuration: schema, loading and live reload."""
