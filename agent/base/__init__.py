"""Small pieces every room uses: typed errors, in-process feeds, backoff, atomic files, directory watching, logging."""
