"""Running kvindex: settings, the composition root, serving workers, metrics wiring, the
CLI."""
