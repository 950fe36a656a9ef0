"""What users run: the command line (and, later, the offline API and the server)."""
