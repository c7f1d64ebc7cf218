"""specfleet coordinator: submit requests and batches to the fleet, stream results, watch it."""
