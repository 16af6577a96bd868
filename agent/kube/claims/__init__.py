"""ResourceClaims as read from the API server, whatever ``resource.k8s.io`` version served them."""
