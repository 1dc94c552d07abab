"""Services that sit on the router like apps: the pub/sub gossip mesh (``pubsub``) and discovery (pure cores)."""
