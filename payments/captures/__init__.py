"""Manual capture: authorise an order's amount, capture all or part of it, release it on give-up."""
