"""HTTP: routes (thin), the resident model, and the hypercorn server."""
