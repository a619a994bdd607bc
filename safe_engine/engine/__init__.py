"""Running requests: the continuous-batching scheduler, the `Ensemble` facade and its streams, and the lazy
holder the adapters share."""
