"""The lighthouse: the job-wide coordinator that forms a quorum each step."""
