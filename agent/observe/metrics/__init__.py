"""Prometheus collectors read from live state at scrape time."""
