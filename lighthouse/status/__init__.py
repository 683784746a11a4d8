"""The lighthouse's status page: what a person reads about the job.

- `server`: the HTTP page, `/status.json` and `/metrics`;
- `view`: the page's memory, fed by the membership's effects;
- `progress`: committed steps over time, step rate and goodput;
- `dashboard`: the page's HTML; `chart`: its SVG chart of steps;
- `kill_button`: the page's kill form (Kill to a replica, with the secret).
"""
