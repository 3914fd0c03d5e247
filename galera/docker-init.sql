-- Run once by galera1's entrypoint when it initialises its data (the joiners receive it
-- by state transfer): the database the demo and the tests use, and the user HAProxy's
-- mysql-check logs in as (no password, no privilege).
CREATE DATABASE IF NOT EXISTS leases CHARACTER SET utf8mb4;
CREATE USER IF NOT EXISTS 'haproxy_check'@'%';
