/* kvferryctl - asks the local kvferryd what it is doing.
 *
 *   kvferryctl [-s SOCKET] [--json] status|pools|peers|transfers
 *
 * The daemon renders the tables and the JSON; this tool only forwards the
 * question and prints the answer. Options may come before or after the
 * command. Exit status: 0 success, 1 the daemon failed or was unreachable,
 * 2 usage error. */
#include "kvferry.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_SOCKET "/run/kvferry/kvferryd.sock"

#define SYNOPSIS "kvferryctl [-s SOCKET] [--json] status|pools|peers|transfers"

enum { EXIT_OK = 0, EXIT_DAEMON = 1, EXIT_USAGE = 2 };

struct command {
  const char *name;
  int what; /* enum kvf_inspect */
  const char *help;
};

static const struct command commands[] = {
  {"status", KVF_INSPECT_STATUS, "the daemon: node, version, transports, counters"},
  {"pools", KVF_INSPECT_POOLS, "memory pools and how they are registered"},
  {"peers", KVF_INSPECT_PEERS, "peer daemons and the state of each connection"},
  {"transfers", KVF_INSPECT_TRANSFERS, "active grants and sends, with their path"},
};

#define N_COMMANDS (sizeof(commands) / sizeof(commands[0]))

struct options {
  const char *socket;
  bool json;
  bool help;
  const char *command;
};

static void usage(FILE *f) {
  fprintf(f,
          "usage: " SYNOPSIS "\n"
          "\n"
          "Options (before or after COMMAND):\n"
          "  -s, --socket PATH  kvferryd's socket (default: $KVFERRY_SOCKET,\n"
          "                     else " DEFAULT_SOCKET ")\n"
          "  --json             print JSON instead of a table\n"
          "  -h, --help         print this help\n"
          "\n"
          "Commands:\n");
  for (size_t i = 0; i < N_COMMANDS; i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
  fprintf(f, "\nExit status: 0 success, 1 daemon error or unreachable, 2 usage error.\n");
}

/* Prints "kvferryctl: PROBLEM [ARG]" and where to find help, to stderr. */
static int usage_error(const char *problem, const char *arg) {
  fprintf(stderr, "kvferryctl: %s%s%s\n", problem, arg ? " " : "", arg ? arg : "");
  fprintf(stderr, "usage: " SYNOPSIS "\nTry 'kvferryctl --help'.\n");
  return EXIT_USAGE;
}

/* Fills opt from argv; returns EXIT_OK or EXIT_USAGE (message printed). */
static int parse_args(int argc, char **argv, struct options *opt) {
  bool only_operands = false; /* after "--" */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!only_operands && a[0] == '-' && a[1] != '\0') {
      if (strcmp(a, "--") == 0) {
        only_operands = true;
      } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
        opt->help = true;
      } else if (strcmp(a, "--json") == 0) {
        opt->json = true;
      } else if (strcmp(a, "-s") == 0 || strcmp(a, "--socket") == 0) {
        if (i + 1 >= argc) return usage_error("missing path after", a);
        opt->socket = argv[++i];
      } else if (strncmp(a, "--socket=", 9) == 0) {
        opt->socket = a + 9;
      } else {
        return usage_error("unknown option", a);
      }
    } else if (!opt->command) {
      opt->command = a;
    } else {
      return usage_error("unexpected argument", a);
    }
  }
  if (opt->socket && !*opt->socket) return usage_error("empty socket path", NULL);
  return EXIT_OK;
}

static const struct command *find_command(const char *name) {
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(commands[i].name, name) == 0) return &commands[i];
  return NULL;
}

static const char *socket_path(const struct options *opt) {
  if (opt->socket) return opt->socket;
  const char *env = getenv("KVFERRY_SOCKET");
  return env && *env ? env : DEFAULT_SOCKET;
}

/* Prints the daemon's text as rendered, ending it with a newline if the
 * daemon did not, so that the shell prompt starts on its own line. */
static int print_text(const char *text) {
  size_t n = strlen(text);
  fputs(text, stdout);
  if (n > 0 && text[n - 1] != '\n') fputc('\n', stdout);
  if (fflush(stdout) != 0 || ferror(stdout)) {
    fprintf(stderr, "kvferryctl: cannot write output\n");
    return EXIT_DAEMON;
  }
  return EXIT_OK;
}

static int run(const struct command *cmd, const char *path, bool json) {
  kvf_client *c;
  int rc = kvf_connect(path, &c);
  if (rc < 0) {
    fprintf(stderr, "kvferryctl: cannot reach kvferryd at %s: %s\n", path, kvf_strerror(rc));
    return EXIT_DAEMON;
  }
  char *text = NULL;
  rc = kvf_inspect(c, cmd->what, json, &text);
  kvf_close(c);
  if (rc < 0) {
    fprintf(stderr, "kvferryctl: %s: %s (%s)\n", cmd->name, kvf_strerror(rc), kvf_err_name(rc));
    return EXIT_DAEMON;
  }
  int status = print_text(text);
  free(text);
  return status;
}

int main(int argc, char **argv) {
  struct options opt = {0};
  int rc = parse_args(argc, argv, &opt);
  if (rc != EXIT_OK) return rc;
  if (opt.help) {
    usage(stdout);
    return EXIT_OK;
  }
  if (!opt.command) return usage_error("missing COMMAND", NULL);
  const struct command *cmd = find_command(opt.command);
  if (!cmd) return usage_error("unknown command", opt.command);
  return run(cmd, socket_path(&opt), opt.json);
}
