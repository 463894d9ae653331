"""Storage of committed steps: a local directory, object stores, and the policy above them."""
