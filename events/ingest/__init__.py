"""The subscriber runtime: receiving, admitting, ordering, recovering and delivering every
stream's batches."""
