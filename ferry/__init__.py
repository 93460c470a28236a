"""The `ferry` command, above both of its halves: `ferry serve` (server/) and `ferry bench` (bench/)."""
