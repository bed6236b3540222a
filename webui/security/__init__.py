"""Who may use the console: the credentials file, sessions, CSRF tokens and login throttling."""
