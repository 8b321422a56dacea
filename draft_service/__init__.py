"""The draft server: serves clients' Generate calls, drafts blocks with a small model and has a remote verifier
decide every token over one multiplexed Verify stream."""
