"""The daemon process: its socket loop, the verbs, the leases it grants, the admin HTTP app."""
